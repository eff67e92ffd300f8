"""Pure planning: shapes, replica counts, LayerSplit layout, revision, validation.

No I/O, no clock, no API client (an import-linter contract enforces it).
"""
