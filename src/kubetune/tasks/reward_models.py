"""A trained reward model's export as the tasks read it: how the reward-model task marks its export (one output named
``reward``, a regression score; ``INPUT``: how its training tokenized a sequence, chat or text), how a (prompt,
answer) sequence is tokenized for it (``answer_ids``, as TRL's RewardTrainer does), and its scores
(``score_ids``; ``Scorer``, the engine of `kubetune predict` and `kubetune serve`). Shared by the reward-model task
(training and inference) and GRPO's ``model`` reward, which scores completions with such an export."""

from __future__ import annotations

import torch

from kubetune.inference.model import context_length, load_model, load_tokenizer
from kubetune.tasks.common import right_pad

LABEL = "reward"  # the one output's name in the exported config (id2label)
INPUT = "kubetune_reward_input"  # the exported config's record of how training tokenized a sequence: chat or text


def answer_ids(tokenizer, prompt, answer) -> list[int]:
    """One (prompt, answer) sequence's token ids as TRL's RewardTrainer makes them, and as the reward model then
    scores it (``Scorer``, GRPO's ``model`` reward): text (strings): the tokenizer on prompt + answer, the answer
    ending with EOS where the tokenizer has one; chat (message lists; a string answer is an assistant turn): the
    chat template on the prompt's and the answer's turns."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt + with_eos(tokenizer, str(answer)))["input_ids"])
    turns = list(answer) if isinstance(answer, list) else [{"role": "assistant", "content": str(answer)}]
    return list(tokenizer.apply_chat_template(list(prompt) + turns, tokenize=True, return_dict=True)["input_ids"])


def with_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_token
    return text if not eos or text.endswith(eos) else text + eos


def is_reward_model(config: dict) -> bool:
    """An exported reward model's config.json: one output named ``reward``, a score (problem_type regression)."""
    labels = config.get("id2label") or {}
    return config.get("problem_type") == "regression" and list(labels.values()) == [LABEL]


class Scorer:
    """A reward model's engine (`kubetune serve` over KServe's v1 and v2, `predict`): the raw score of each text,
    tokenized as the model's training tokenized a whole sequence (its config's ``INPUT``): a chat model's text is a
    rendered conversation (no special tokens added, as the chat template's own tokenization adds none); a text model's
    gets EOS appended where the tokenizer has one. Batched, right-padded, cut to the model's context."""

    outputs = {"score": "FP32"}

    def __init__(self, path, batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = load_tokenizer(path)
        self.model = load_model(AutoModelForSequenceClassification, path).eval()
        self.chat = getattr(self.model.config, INPUT, "text") == "chat"
        self.limit = context_length(self.model.config, self.tokenizer)
        self.batch_size = batch_size

    def ids(self, text: str) -> list[int]:
        if self.chat:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(with_eos(self.tokenizer, text))["input_ids"]
        return list(ids)[: self.limit]

    @torch.no_grad()
    def scores(self, texts: list[str]) -> list[float]:
        return score_ids(self.model, [self.ids(t) for t in texts], self.batch_size)

    def run(self, texts: list[str]) -> list[dict]:
        return [{"score": s} for s in self.scores(texts)]


@torch.no_grad()
def score_ids(model, seqs: list[list[int]], batch_size: int = 16) -> list[float]:
    """A reward model's score of each token id sequence, in right-padded batches (its config's pad token, which it
    finds each row's last real token by), on the model's device."""
    device, pad = next(model.parameters()).device, model.config.pad_token_id or 0
    out: list[float] = []
    for start in range(0, len(seqs), batch_size):
        ids, mask = right_pad(seqs[start : start + batch_size], pad)
        out += model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().reshape(-1).tolist()
    return out
