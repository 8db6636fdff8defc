"""Fill in the derived labels of the retrieval query set: ``python tools/label_queries.py [FILE] [--check]``.

For each question of the set (default: the one shipped,
``services/switchyard/retrieval/data/pydoc_queries.jsonl``) it sets

- ``topics``: every CPython documentation topic (``pydoc_data.topics``) whose
  text holds the question's ``evidence`` phrase (whitespace runs compared as
  one space); a phrase found nowhere is an error;
- ``tail``: true when, under the old character chunking (900 characters, 100
  overlap), every passage holding the phrase has it only past the 254 word
  pieces all-MiniLM-L6-v2 embeds (256 less [CLS] and [SEP]).

``--check`` changes nothing and exits 1 when a label differs from what it
would write (for example after a Python upgrade changed the topics).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from switchyard.retrieval.chunking import chunk_document, embedding_text, token_length
from switchyard.retrieval.documents import pydoc_documents
from switchyard.retrieval.quality import QUERIES_FILE, normalize

OLD_CHUNK_CHARS, OLD_OVERLAP_CHARS = 900, 100


def _embedded_head(text: str, budget: int, length) -> str:
    """The longest prefix of ``text`` with at most ``budget`` word pieces (what the model saw)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=str(QUERIES_FILE))
    parser.add_argument("--check", action="store_true", help="report labels that differ; write nothing")
    args = parser.parse_args(argv)

    from switchyard.retrieval.embedder import load_embedder

    embedder = load_embedder()
    length = token_length(embedder.tokenizer)
    budget = embedder.window - embedder.tokenizer.num_special_tokens_to_add(pair=False)
    docs = pydoc_documents()
    texts = {d.title: normalize(d.text) for d in docs}
    heads: dict[str, list[tuple[str, str]]] = {}  # topic -> [(passage text, embedded part)]
    for doc in docs:
        for passage in chunk_document(doc, OLD_CHUNK_CHARS, OLD_OVERLAP_CHARS):
            full = embedding_text(passage, doc.heading)
            heads.setdefault(doc.title, []).append(
                (normalize(passage.text), normalize(_embedded_head(full, budget, length))))

    path = Path(args.file)
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    changed = 0
    for item in items:
        evidence = normalize(item["evidence"])
        topics = [t for t, text in texts.items() if evidence in text]
        if not topics:
            print(f"{item['id']}: evidence {evidence!r} is in no topic", file=sys.stderr)
            return 2
        holding = [(text, head) for t in topics for text, head in heads[t] if evidence in text]
        tail = bool(holding) and not any(evidence in head for _, head in holding)
        if item.get("topics") != topics or item.get("tail") != tail:
            changed += 1
            if args.check:
                print(f"{item['id']}: topics {item.get('topics')} -> {topics}, tail {item.get('tail')} -> {tail}")
        item["topics"], item["tail"] = topics, tail
    if args.check:
        print(f"{len(items)} questions, {changed} with labels to update")
        return 1 if changed else 0
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    print(f"{len(items)} questions ({sum(i['tail'] for i in items)} tail), {changed} relabelled: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
