"""The build-DDP lab as a package: its helpers are ``build_ddp.adapter``, ``build_ddp.harness`` and
``build_ddp.checks``, never top-level names that a file of yours or an installed package could shadow (or be
shadowed by). The file you write is ``student.py``; the tests load it under a name of its own (adapter.py)."""
