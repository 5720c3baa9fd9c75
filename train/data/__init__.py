"""The run's documents, from their source to fixed-shape batches; what a task makes of them is the task's
(train/tasks/).

- sources.py: the sources a run reads (--dataset; python -m train predict's --input) and their columns
- splits.py: the parts of the 'train'/'eval' split tasks share (deduplication, held-out shares, samples)
- batches.py: the fixed-shape, seeded batch order every task shares (BatchLoader), each host's rows
- packing.py: documents packed into rows of one length (a causal LM's training; predict's whole documents)
- context_order.py: --balance-context's dual-chunk token order of causal-LM batches
"""
