"""One module per `restopo` subcommand, each with register(subparsers)."""
