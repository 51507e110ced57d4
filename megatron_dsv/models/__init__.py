"""Models and layer specs."""
