"""Preparing the model under a policy, in one home: the first build and a new policy mid-run
(:mod:`~mixprec.engine.preparation.prepare`; ``set_policy``: :mod:`~mixprec.engine.preparation.switch`), an optimizer
attached to it (:mod:`~mixprec.engine.preparation.attach`), a run's state changing mid-way (a load, an unfreeze:
:mod:`~mixprec.engine.preparation.reprepare`) and a model edited after the build (:mod:`~mixprec.engine.preparation.edits`);
each re-prepares through the one path, ``prepare``."""
