"""Tools around training: the command line, ``check``, ``demo``, ``launch``, the report and ``grade`` (instructors).

They may import any layer; the lesson core, ``robust`` and ``speed`` never import them (``lint-imports``).
"""
