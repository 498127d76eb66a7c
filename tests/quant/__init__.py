"""Low-precision tests (a package: its module names must not clash with other folders' test_formats / test_recipe)."""
