"""The silent-precision benchmark's parts (benchmarks/bench_silent.py): ``cases`` (planted cases
and look-alike controls, each citing its thread), ``builders`` / ``models`` / ``kernels`` (the
models, from tiny configs or hand-written), ``truth`` (f32 against the recipe, measured for real
on CPU) and ``scoring`` (the audit's CW14x findings against the expected op, module and origin)."""
