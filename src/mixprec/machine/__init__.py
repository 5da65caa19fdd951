"""The machine: what each device can run (capability), how fast its matmuls are (matmul), the one device sync
and timer every measurement goes through (timing), and the measurements cached between processes (cache)."""
