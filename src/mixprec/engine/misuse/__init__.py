"""What a loop or a framework does wrong around the engine, made loud: bad arguments and inputs
(:mod:`~mixprec.engine.misuse.arguments`), the loop's silent mistakes (foreign gradients, a model cast after build,
a forward outside ``mp.autocast()``: :mod:`~mixprec.engine.misuse.loop_checks`; a batch field that looks like a
target: :mod:`~mixprec.engine.misuse.cast_targets`), frameworks working around the
engine (someone else's autocast, an optimizer stepped by another loop: :mod:`~mixprec.engine.misuse.outside`) and
a framework loop's habits (Accelerate's accumulation, processes and clipping: :mod:`~mixprec.engine.misuse.foreign_loops`).
The step's order of calls is :mod:`mixprec.engine.step_state`'s."""
