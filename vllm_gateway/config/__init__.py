"""Settings: declared once as frozen dataclasses, loaded from TOML < env < flags, validated,
documented.
"""
