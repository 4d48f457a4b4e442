"""The solutions of the chapters' exercises, one file per chapter (``chNN.py``).

Each file defines, for every checker of its chapter, a top-level object named by the checker's
``answer``. A chapter's ``## Solutions`` section, after all its exercises, runs its file with
``runpy.run_path`` (which, unlike an import, writes no bytecode into the checkout) and passes
each solution to its checker; tests/test_exercises.py does the same for the whole book.
"""
