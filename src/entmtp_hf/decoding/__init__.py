"""The decode loop ``generate`` hands over to: draft, verify, accept, commit."""
