"""A run's model as transformers loads it: `export/hf/` (`pipeline("decision", trust_remote_code=True)`)."""
