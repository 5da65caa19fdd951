"""The machine: measurements cached between processes, one timer and one device sync."""
