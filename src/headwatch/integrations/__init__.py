"""Front doors that feed headwatch's trainer-free core from an engine (Lightning, a plain loop, ...)."""
