"""The data sets specplan carries (README.md says what they are and where they come from)."""
