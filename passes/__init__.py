"""speedc.passes."""
