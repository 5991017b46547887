"""Example agent harnesses for the `external` loop."""
