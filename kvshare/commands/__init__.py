"""One module per ``kvshare`` subcommand: add_arguments(parser) and run(args) -> exit code."""
