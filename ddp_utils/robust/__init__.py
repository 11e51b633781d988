"""Robustness: what keeps a run on real nodes from failing silently or losing work.

Pre-flight network checks, the re-runnable rendezvous, the backend agreement, CPU threads per rank, the
other ranks as the kit hears of them (failures, explicit waits, a lost peer), the watch over them, ``--resume
auto`` and atomic file writes. The layer below the lesson core: it imports nothing of the kit above it
(``lint-imports``), and the core calls it inside its steps (``distributed.setup``, ``train.fit``, ...); a student can
read the core without it.
"""
