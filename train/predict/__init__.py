"""``python -m train predict``: a model labels, scores or embeds a collection of documents in packed rows,
on every local device, each document exactly once (docs/predict.md).

- cli.py: the command (parse, build, predict, close); config.py: its flags
- documents.py: reading --input (train/data/sources.py's readers) and each process's share
- model.py: the model, its task's Head (train/tasks/), tokenizer and lengths, loaded for a run and --compile-only
- windows.py: documents into token windows (--max-length, --long, --stride)
- runner.py: the model on the devices (one, or an SPMD mesh) and the fixed-shape step
- job.py: one run, shard by shard; shards.py and manifest.py: the output, exactly once
- report.py: progress and summary; compile.py: --compile-only
"""
