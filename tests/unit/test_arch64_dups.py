"""Issue 64 (item 1, the repeated code in tasks/): every task's presentation (report rows, model card lines,
headline, summary, plots) reads to the letter as it did before its shared pieces moved to ``tasks.common`` /
``tasks.causal``. The expected values were recorded from the code before the move, for a fixed metrics dict."""

from __future__ import annotations

from kubetune import tasks

M = {
    "eval_loss": 0.5123456,
    "train_loss": 0.61234,
    "eval_pairs": 40,
    "eval_examples": 44,
    "eval_prompts": 12,
    "eval_rows": 30,
    "eval_tokens": 1234,
    "eval_perplexity": 1.66789,
    "eval_token_accuracy": 0.54321,
    "eval_reward_accuracy": 0.625,
    "eval_reward_margin": 0.1234567,
    "eval_reward_chosen": 0.2345678,
    "eval_reward_rejected": -0.11111,
    "eval_kl": 0.0456789,
    "eval_log_odds_ratio": -0.6543,
    "eval_nll_loss": 1.2345,
    "eval_accuracy": 0.8125,
    "eval_margin": 0.987654,
    "eval_mean_reward": 0.1111,
    "eval_f1_macro": 0.7777777,
    "eval_reward": 0.4321,
    "eval_reward_format": 0.5,
    "eval_completion_length": 17.25,
    "eval_completion_truncated": 0.125,
    "dpo_loss": "sigmoid",
    "dpo_beta": 0.1,
    "dpo_label_smoothing": 0.0,
    "dpo_reference": "precomputed (full fine-tune)",
    "orpo_beta": 0.2,
    "kto_beta": 0.1,
    "kto_desirable_weight": 1.0,
    "kto_undesirable_weight": 1.5,
    "kto_train_desirable": 10,
    "kto_train_undesirable": 12,
    "kto_reference": "a frozen copy of the base model",
    "grpo_loss": "dapo",
    "grpo_num_generations": 4,
    "grpo_beta": 0.0,
    "grpo_rewards": ["length", "format"],
    "grpo_reference": None,
    "center_rewards_coefficient": 0.01,
    "margin_column": None,
    "data_format": "chat",
    "chat_template": "chatml",
    "packing": True,
    "train_data_tokens": 999,
    "train_data_target_tokens": 555,
    "labels": ["neg", "pos"],
    "baseline": {"method": "TF-IDF + LR", "accuracy": 0.7, "f1_macro": 0.65},
}
M2 = {**M, "chat_template": None, "data_format": "text"}


def _outputs() -> dict:
    out = {}
    for name in tasks.names():
        p = tasks.get(name).present
        for tag, m in (("chat", M), ("text", M2)):
            out[f"{name}/{tag}"] = {
                "rows": [(a, repr(b)) for a, b in p.report_rows(m)],
                "card_about": p.card_about(m),
                "headline": p.headline(m),
                "summary": p.summary(m),
                "card_usage": p.card_usage("me/model"),
                "ref": (p.reference_line(m), p.reference_html(m, "m"), p.reference_summary(m), p.reference_card(m)),
            }
        out[f"{name}/static"] = {
            "pipeline_tag": p.pipeline_tag,
            "eval_curves": p.eval_curves,
            "eval_log_scale": p.eval_log_scale,
            "step_plots": p.step_plots,
            "loss_label": p.loss_label,
            "card_metrics": p.card_metrics,
        }
    return out


EXPECTED = {
    "causal-lm/chat": {
        "card_about": ["Data format: chat; chat template: chatml."],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "eval perplexity 1.67",
        "ref": (None, "", [], []),
        "rows": [
            ("eval perplexity", "1.66789"),
            ("eval next-token accuracy (target tokens)", "0.54321"),
            ("eval target tokens", "1234"),
            ("data format", "'chat'"),
            ("chat template", "'chatml'"),
            ("packing", "True"),
            ("training data tokens / with loss (one epoch)", "'999 / 555'"),
        ],
        "summary": "eval loss 0.5123, perplexity 1.67 on 1234 target tokens of 30 held-out rows",
    },
    "causal-lm/static": {
        "card_metrics": ("eval_perplexity", "eval_token_accuracy", "eval_loss", "train_loss"),
        "eval_curves": ("eval_perplexity",),
        "eval_log_scale": True,
        "loss_label": "cross-entropy",
        "pipeline_tag": "text-generation",
        "step_plots": (),
    },
    "causal-lm/text": {
        "card_about": ["Data format: text; chat template: none."],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "eval perplexity 1.67",
        "ref": (None, "", [], []),
        "rows": [
            ("eval perplexity", "1.66789"),
            ("eval next-token accuracy (target tokens)", "0.54321"),
            ("eval target tokens", "1234"),
            ("data format", "'text'"),
            ("chat template", "'none (plain text)'"),
            ("packing", "True"),
            ("training data tokens / with loss (one epoch)", "'999 / 555'"),
        ],
        "summary": "eval loss 0.5123, perplexity 1.67 on 1234 target tokens of 30 held-out rows",
    },
    "dpo/chat": {
        "card_about": [
            "Preference-tuned with DPO (sigmoid loss, beta 0.1); the reference model is precomputed "
            "(full fine-tune). On 40 held-out pairs the reward accuracy is 0.6250 and the mean reward "
            "margin 0.1235.",
            "Data format: chat; chat template: chatml.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "reward accuracy 0.6250",
        "ref": (None, "", [], []),
        "rows": [
            ("eval reward accuracy (chosen reward > rejected)", "0.625"),
            ("eval reward margin (mean)", "0.1234567"),
            ("eval rewards chosen / rejected", "'0.2346 / -0.1111'"),
            ("eval pairs", "40"),
            ("dpo loss, beta, label smoothing", "'sigmoid, 0.1, 0.0'"),
            ("reference model", "'precomputed (full fine-tune)'"),
            ("data format", "'chat'"),
            ("chat template", "'chatml'"),
        ],
        "summary": "reward accuracy 0.6250, margin 0.1235, eval loss 0.5123 on 40 held-out pairs",
    },
    "dpo/static": {
        "card_metrics": ("eval_loss", "train_loss"),
        "eval_curves": (),
        "eval_log_scale": False,
        "loss_label": "DPO loss",
        "pipeline_tag": "text-generation",
        "step_plots": (
            ("Reward accuracy", ("reward_accuracy", "eval_reward_accuracy")),
            ("Rewards", ("reward_chosen", "reward_rejected", "reward_margin", "eval_reward_margin")),
        ),
    },
    "dpo/text": {
        "card_about": [
            "Preference-tuned with DPO (sigmoid loss, beta 0.1); the reference model is precomputed "
            "(full fine-tune). On 40 held-out pairs the reward accuracy is 0.6250 and the mean reward "
            "margin 0.1235.",
            "Data format: text; chat template: none.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "reward accuracy 0.6250",
        "ref": (None, "", [], []),
        "rows": [
            ("eval reward accuracy (chosen reward > rejected)", "0.625"),
            ("eval reward margin (mean)", "0.1234567"),
            ("eval rewards chosen / rejected", "'0.2346 / -0.1111'"),
            ("eval pairs", "40"),
            ("dpo loss, beta, label smoothing", "'sigmoid, 0.1, 0.0'"),
            ("reference model", "'precomputed (full fine-tune)'"),
            ("data format", "'text'"),
            ("chat template", "'none (text pairs)'"),
        ],
        "summary": "reward accuracy 0.6250, margin 0.1235, eval loss 0.5123 on 40 held-out pairs",
    },
    "grpo/chat": {
        "card_about": [
            "Trained with GRPO (online RL; dapo loss, 4 completions per prompt, rewards: length, "
            "format). On 12 held-out prompts the mean reward of a greedy completion is 0.4321.",
            "Data format: chat; chat template: chatml.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "mean reward 0.4321",
        "ref": (None, "", [], []),
        "rows": [
            ("eval mean reward (greedy, one completion per prompt)", "0.4321"),
            ("eval reward accuracy", "0.625"),
            ("eval reward margin", "0.1234567"),
            ("eval reward chosen", "0.2345678"),
            ("eval reward rejected", "-0.11111"),
            ("eval reward format", "0.5"),
            ("eval completion length (tokens), truncated share", "'17.2, 0.125'"),
            ("eval prompts", "12"),
            ("rewards", "'length, format'"),
            ("grpo loss, completions per prompt, beta", "'dapo, 4, 0.0'"),
            ("reference model", "'none (beta 0)'"),
            ("data format", "'chat'"),
            ("chat template", "'chatml'"),
        ],
        "summary": "mean reward 0.4321 on 12 held-out prompts (greedy)",
    },
    "grpo/static": {
        "card_metrics": ("eval_reward", "train_loss"),
        "eval_curves": (),
        "eval_log_scale": False,
        "loss_label": "GRPO loss",
        "pipeline_tag": "text-generation",
        "step_plots": (
            ("Reward", ("reward", "eval_reward")),
            ("Completion length (tokens)", ("completion_length", "eval_completion_length")),
            ("Policy", ("kl", "entropy", "clip_ratio_region")),
        ),
    },
    "grpo/text": {
        "card_about": [
            "Trained with GRPO (online RL; dapo loss, 4 completions per prompt, rewards: length, "
            "format). On 12 held-out prompts the mean reward of a greedy completion is 0.4321.",
            "Data format: text; chat template: none.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "mean reward 0.4321",
        "ref": (None, "", [], []),
        "rows": [
            ("eval mean reward (greedy, one completion per prompt)", "0.4321"),
            ("eval reward accuracy", "0.625"),
            ("eval reward margin", "0.1234567"),
            ("eval reward chosen", "0.2345678"),
            ("eval reward rejected", "-0.11111"),
            ("eval reward format", "0.5"),
            ("eval completion length (tokens), truncated share", "'17.2, 0.125'"),
            ("eval prompts", "12"),
            ("rewards", "'length, format'"),
            ("grpo loss, completions per prompt, beta", "'dapo, 4, 0.0'"),
            ("reference model", "'none (beta 0)'"),
            ("data format", "'text'"),
            ("chat template", "'none (text prompts)'"),
        ],
        "summary": "mean reward 0.4321 on 12 held-out prompts (greedy)",
    },
    "kto/chat": {
        "card_about": [
            "Preference-tuned with KTO (beta 0.1) on unpaired answers flagged desirable or not; the "
            "reference model is a frozen copy of the base model. On 44 held-out examples the reward "
            "margin (desirable − undesirable) is 0.1235.",
            "Data format: chat; chat template: chatml.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "reward margin 0.1235",
        "ref": (None, "", [], []),
        "rows": [
            ("eval reward margin (desirable − undesirable, β × log-ratio)", "0.1234567"),
            ("eval rewards desirable / undesirable", "'0.2346 / -0.1111'"),
            ("eval KL estimate", "0.0456789"),
            ("eval examples", "44"),
            ("kto beta, desirable / undesirable weight", "'0.1, 1.0 / 1.5'"),
            ("train examples desirable / undesirable", "'10 / 12'"),
            ("reference model", "'a frozen copy of the base model'"),
            ("data format", "'chat'"),
            ("chat template", "'chatml'"),
        ],
        "summary": "reward margin 0.1235, kl 0.0457, eval loss 0.5123 on 44 held-out examples",
    },
    "kto/static": {
        "card_metrics": ("eval_loss", "train_loss"),
        "eval_curves": (),
        "eval_log_scale": False,
        "loss_label": "KTO loss",
        "pipeline_tag": "text-generation",
        "step_plots": (
            ("Rewards", ("reward_chosen", "reward_rejected", "reward_margin", "eval_reward_margin")),
            ("KL estimate", ("kl", "eval_kl")),
        ),
    },
    "kto/text": {
        "card_about": [
            "Preference-tuned with KTO (beta 0.1) on unpaired answers flagged desirable or not; the "
            "reference model is a frozen copy of the base model. On 44 held-out examples the reward "
            "margin (desirable − undesirable) is 0.1235.",
            "Data format: text; chat template: none.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "reward margin 0.1235",
        "ref": (None, "", [], []),
        "rows": [
            ("eval reward margin (desirable − undesirable, β × log-ratio)", "0.1234567"),
            ("eval rewards desirable / undesirable", "'0.2346 / -0.1111'"),
            ("eval KL estimate", "0.0456789"),
            ("eval examples", "44"),
            ("kto beta, desirable / undesirable weight", "'0.1, 1.0 / 1.5'"),
            ("train examples desirable / undesirable", "'10 / 12'"),
            ("reference model", "'a frozen copy of the base model'"),
            ("data format", "'text'"),
            ("chat template", "'none (text)'"),
        ],
        "summary": "reward margin 0.1235, kl 0.0457, eval loss 0.5123 on 44 held-out examples",
    },
    "orpo/chat": {
        "card_about": [
            "Preference-tuned with ORPO (λ 0.2; no reference model). On 40 held-out pairs the chosen "
            "answer is the likelier one 62.50% of the time.",
            "Data format: chat; chat template: chatml.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "reward accuracy 0.6250",
        "ref": (None, "", [], []),
        "rows": [
            ("eval reward accuracy (chosen answer likelier than rejected)", "0.625"),
            ("eval reward margin (λ × mean log-probability)", "0.1234567"),
            ("eval log odds ratio (log σ)", "-0.6543"),
            ("eval NLL of the chosen sequences", "1.2345"),
            ("eval pairs", "40"),
            ("orpo λ (beta)", "0.2"),
            ("data format", "'chat'"),
            ("chat template", "'chatml'"),
        ],
        "summary": "reward accuracy 0.6250, margin 0.1235, eval loss 0.5123 on 40 held-out pairs",
    },
    "orpo/static": {
        "card_metrics": ("eval_loss", "train_loss"),
        "eval_curves": (),
        "eval_log_scale": False,
        "loss_label": "ORPO loss (NLL − λ log σ(log odds))",
        "pipeline_tag": "text-generation",
        "step_plots": (
            ("Reward accuracy", ("reward_accuracy", "eval_reward_accuracy")),
            ("Reward margin and log odds", ("reward_margin", "eval_reward_margin", "log_odds_chosen")),
        ),
    },
    "orpo/text": {
        "card_about": [
            "Preference-tuned with ORPO (λ 0.2; no reference model). On 40 held-out pairs the chosen "
            "answer is the likelier one 62.50% of the time.",
            "Data format: text; chat template: none.",
        ],
        "card_usage": [
            'gen = pipeline("text-generation", model="me/model")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        "headline": "reward accuracy 0.6250",
        "ref": (None, "", [], []),
        "rows": [
            ("eval reward accuracy (chosen answer likelier than rejected)", "0.625"),
            ("eval reward margin (λ × mean log-probability)", "0.1234567"),
            ("eval log odds ratio (log σ)", "-0.6543"),
            ("eval NLL of the chosen sequences", "1.2345"),
            ("eval pairs", "40"),
            ("orpo λ (beta)", "0.2"),
            ("data format", "'text'"),
            ("chat template", "'none (text pairs)'"),
        ],
        "summary": "reward accuracy 0.6250, margin 0.1235, eval loss 0.5123 on 40 held-out pairs",
    },
    "reward-model/chat": {
        "card_about": [
            "A reward model (one score per text) trained on preference pairs with the "
            "Bradley-Terry loss. On 40 held-out pairs it scores the chosen answer above the "
            "rejected one 81.25% of the time, by 0.9877 on average.",
            "Data format: chat; chat template: chatml.",
        ],
        "card_usage": [
            'scorer = pipeline("text-classification", model="me/model", function_to_apply="none")',
            'scorer("Question: ...\\nAnswer: ...")[0]["score"]  # the raw reward',
        ],
        "headline": "pairwise accuracy 0.8125",
        "ref": (None, "", [], []),
        "rows": [
            ("eval pairwise accuracy (chosen scored above rejected)", "0.8125"),
            ("eval reward margin (mean r_chosen − r_rejected)", "0.987654"),
            ("eval mean reward", "0.1111"),
            ("eval pairs", "40"),
            ("center_rewards_coefficient", "0.01"),
            ("margin column", "'none'"),
            ("data format", "'chat'"),
            ("chat template", "'chatml'"),
        ],
        "summary": "pairwise accuracy 0.8125, margin 0.9877, eval loss 0.5123 on 40 held-out pairs",
    },
    "reward-model/static": {
        "card_metrics": ("eval_accuracy", "eval_margin", "train_loss"),
        "eval_curves": (),
        "eval_log_scale": False,
        "loss_label": "Bradley-Terry loss",
        "pipeline_tag": "text-classification",
        "step_plots": (
            ("Pairwise accuracy", ("accuracy", "eval_accuracy")),
            ("Reward margin", ("margin", "eval_margin")),
        ),
    },
    "reward-model/text": {
        "card_about": [
            "A reward model (one score per text) trained on preference pairs with the "
            "Bradley-Terry loss. On 40 held-out pairs it scores the chosen answer above the "
            "rejected one 81.25% of the time, by 0.9877 on average.",
            "Data format: text; chat template: none.",
        ],
        "card_usage": [
            'scorer = pipeline("text-classification", model="me/model", function_to_apply="none")',
            'scorer("Question: ...\\nAnswer: ...")[0]["score"]  # the raw reward',
        ],
        "headline": "pairwise accuracy 0.8125",
        "ref": (None, "", [], []),
        "rows": [
            ("eval pairwise accuracy (chosen scored above rejected)", "0.8125"),
            ("eval reward margin (mean r_chosen − r_rejected)", "0.987654"),
            ("eval mean reward", "0.1111"),
            ("eval pairs", "40"),
            ("center_rewards_coefficient", "0.01"),
            ("margin column", "'none'"),
            ("data format", "'text'"),
            ("chat template", "'none (text pairs)'"),
        ],
        "summary": "pairwise accuracy 0.8125, margin 0.9877, eval loss 0.5123 on 40 held-out pairs",
    },
    "sequence-classification/chat": {
        "card_about": ["Labels: neg, pos."],
        "card_usage": ['clf = pipeline("text-classification", model="me/model")'],
        "headline": "eval accuracy 0.8125",
        "ref": (
            (0.7, "baseline accuracy (TF-IDF + LR)"),
            "<h2>Against a baseline on the same "
            "split</h2><table><tr><th></th><th>accuracy</th><th>macro-F1</th></tr><tr><th>fine-tuned "
            "m</th><td>0.8125</td><td>0.7778</td></tr><tr><th>TF-IDF + "
            "LR</th><td>0.7000</td><td>0.6500</td></tr></table><p>The fine-tuned model "
            "beats the baseline by +11.3 accuracy points.</p>",
            ["baseline TF-IDF + LR: accuracy 0.7000, macro-F1 0.6500 -> fine-tuned model beats it by +11.3 points"],
            ["| baseline accuracy (TF-IDF + LR) | 0.7000 |"],
        ),
        "rows": [("eval accuracy", "0.8125"), ("eval macro-F1", "0.7777777")],
        "summary": "eval accuracy 0.8125, macro-F1 0.7778 on 30 held-out rows",
    },
    "sequence-classification/static": {
        "card_metrics": ("eval_accuracy", "eval_f1_macro", "eval_loss", "train_loss"),
        "eval_curves": ("eval_accuracy", "eval_f1_macro"),
        "eval_log_scale": False,
        "loss_label": "cross-entropy",
        "pipeline_tag": "text-classification",
        "step_plots": (),
    },
    "sequence-classification/text": {
        "card_about": ["Labels: neg, pos."],
        "card_usage": ['clf = pipeline("text-classification", model="me/model")'],
        "headline": "eval accuracy 0.8125",
        "ref": (
            (0.7, "baseline accuracy (TF-IDF + LR)"),
            "<h2>Against a baseline on the same "
            "split</h2><table><tr><th></th><th>accuracy</th><th>macro-F1</th></tr><tr><th>fine-tuned "
            "m</th><td>0.8125</td><td>0.7778</td></tr><tr><th>TF-IDF + "
            "LR</th><td>0.7000</td><td>0.6500</td></tr></table><p>The fine-tuned model "
            "beats the baseline by +11.3 accuracy points.</p>",
            ["baseline TF-IDF + LR: accuracy 0.7000, macro-F1 0.6500 -> fine-tuned model beats it by +11.3 points"],
            ["| baseline accuracy (TF-IDF + LR) | 0.7000 |"],
        ),
        "rows": [("eval accuracy", "0.8125"), ("eval macro-F1", "0.7777777")],
        "summary": "eval accuracy 0.8125, macro-F1 0.7778 on 30 held-out rows",
    },
}


def test_every_task_presentation_reads_as_before():
    got = _outputs()
    assert sorted(got) == sorted(EXPECTED)
    for key, want in EXPECTED.items():
        assert got[key] == want, key
