"""Tools around training: the command line, ``check``, ``demo``, ``launch`` and the report.

They may import any layer; the lesson core, ``robust`` and ``speed`` never import them (``lint-imports``).
"""
