"""Training recipes: one linear loop per task."""
