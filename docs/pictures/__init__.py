"""The documentation's pictures, each drawn by one script of this folder from the package's own output.

``python docs/pictures/NAME.py`` runs the package (``mgpu-train`` on CPU processes, ``mgpu-plan``, the layout's rank
groups, the chaos benchmark), keeps what a picture is drawn from in ``docs/pictures/data/`` and draws it into
``docs/images/``. ``--smoke --out DIR`` draws every picture of the script into ``DIR`` cheaply: from the data kept in
the repository where a run takes minutes, checking that the data holds what the picture shows and that the commands
that recorded it still compose and pass ``mgpu-train``'s checks (``tests/docs/test_pictures.py``, so ``make test``).
The folder is not part of the site (``exclude_docs`` in ``mkdocs.yml``).
"""
