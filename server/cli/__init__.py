"""The `s2s` command, one module per subcommand (`main` dispatches)."""
