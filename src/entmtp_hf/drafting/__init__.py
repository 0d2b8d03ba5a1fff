"""Drafting a tree each step: the candidate generator and retrieval branches."""
