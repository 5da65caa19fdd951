"""mixprec inside the trainers people already use (docs/integrations.md): one module per framework, each
importing its framework only when imported itself, so ``import mixprec`` never needs Lightning or transformers."""
