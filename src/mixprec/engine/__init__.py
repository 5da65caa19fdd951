"""The training-step engine and its collaborators: storage, regions, masters, loss scale, checks."""
