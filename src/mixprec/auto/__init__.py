"""``policy="auto"`` in one home: the trial that times the candidate policies on the user's model
(:mod:`~mixprec.auto.trial`) and the engine's pending decision, taken at the first training forward
(:mod:`~mixprec.auto.pending`); which candidates a device offers is the policy resolution's
(:func:`mixprec.policy.resolve.auto_candidates`)."""
