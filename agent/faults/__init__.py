"""The fault pipeline: the service that feeds driver observations to the rules (`rules/`), the durable log, and the hub that fans changes out."""
