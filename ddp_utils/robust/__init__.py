"""Robustness: what keeps a run on real nodes from failing silently or losing work.

Pre-flight network checks, the re-runnable rendezvous, the backend agreement, CPU threads per rank, the
watch over the other ranks, ``--resume auto`` and atomic file writes. The lesson core calls these inside
its steps (``distributed.setup``, ``train.fit``, ...); a student can read the core without them.
"""
