"""The commands of the command line (aiofabric/tools/cli.py builds its parser from them): each module adds its
commands' parsers, checks their arguments and runs them."""
