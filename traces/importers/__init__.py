"""Importers from other engines' route logs into trace format v1."""
