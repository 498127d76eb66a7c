"""Environment plug-in layers: agent functions, integrations."""
