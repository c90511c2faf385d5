"""genomelm: long-context genome language modelling."""
