"""The ``tetris`` command line."""
