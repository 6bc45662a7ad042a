"""A TF-IDF + logistic-regression baseline on exactly the same train/eval split."""

from __future__ import annotations


def tfidf_baseline(frames) -> dict:
    """Fit on ``frames.train``, score on ``frames.eval``; returns accuracy and macro-F1."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score

    def texts(df):
        return (df["text"] + " [SEP] " + df["text_pair"]) if "text_pair" in df else df["text"]

    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
    x_train = vec.fit_transform(texts(frames.train))
    clf = LogisticRegression(max_iter=1000, C=10.0).fit(x_train, frames.train["label"])
    pred = clf.predict(vec.transform(texts(frames.eval)))
    return {
        "accuracy": float(accuracy_score(frames.eval["label"], pred)),
        "f1_macro": float(f1_score(frames.eval["label"], pred, average="macro")),
        "method": "TF-IDF (1-2 grams, sublinear tf) + logistic regression (C=10)",
    }
