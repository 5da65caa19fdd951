"""The divergence guard's parts (:class:`mixprec.Guard` in :mod:`mixprec.guard` is the entry point): its knobs and
counts (:mod:`~mixprec.safety.config`) and the escalation ladder (:mod:`~mixprec.safety.escalation`); docs/safety.md."""
