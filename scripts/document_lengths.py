"""The token lengths of the documents packed documents come from, as layouts for the schedule reader
(``python -m torchattn.aot --documents FILE``, ``scripts/bench_schedule.py --documents FILE``): one length per
line, in the collection's order.

    .venv-current/bin/python scripts/document_lengths.py     # docs/bench/layouts/*.txt, about a minute

- bbc-news.txt: every BBC News article (train/data/sources.py), MiniLM's tokenizer (the classification recipe's
  model), special tokens included;
- sotu-paragraphs.txt: every State of the Union paragraph (an address split at blank lines, as
  scripts/bench_predict.py splits them), SmolLM2-135M's tokenizer (the sotu-lm recipe's model).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OUT = os.path.join(ROOT, "docs", "bench", "layouts")


def main() -> int:
    from train import models
    from train.checkpoint.durable import write_text
    from train.data import sources

    collections = {
        "bbc-news.txt": ("minilm", [text for split in sources.open_source("bbc-news").values()
                                    for text in split["text"]]),
        "sotu-paragraphs.txt": ("smollm2-135m", [paragraph for split in sources.open_source("sotu").values()
                                                 for text in split["text"] for paragraph in text.split("\n\n")
                                                 if paragraph.strip()]),
    }
    os.makedirs(OUT, exist_ok=True)
    for name, (model, texts) in collections.items():
        _, where, load = models.pretrained_config(model)
        tokenizer = models.load_tokenizer(model, where, load)
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
        write_text(os.path.join(OUT, name), "".join(f"{n}\n" for n in lengths))
        lengths.sort()
        print(f"{name}: {len(lengths)} documents, median {lengths[len(lengths) // 2]} tokens, "
              f"5-95 % {lengths[len(lengths) // 20]}-{lengths[len(lengths) * 19 // 20]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
