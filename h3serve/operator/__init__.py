"""The H3Deployment operator (import name `h3serve.operator`): pure renderer and status, kopf handlers, CLI."""
