"""Test and benchmark support: fault injection, peer processes, namespaces."""
