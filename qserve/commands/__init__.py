"""The `qserve` subcommands, registered on the group in `qserve.cli`.

common.py    engine options, request limits, settings from the command line over a recipe
engine.py    generate, serve, eval
quantize.py  quantize
recipes.py   recipes list | show | check
"""
