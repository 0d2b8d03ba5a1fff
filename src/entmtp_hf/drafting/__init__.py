"""Drafting every live row's tree each step: the call's drafter and retrieval branches."""
