"""cedar.frontend: SGLang frontend-language programs against a Cedar server. Importing it changes
nothing in SGLang; making a `CedarEndpoint` installs the interpreter fix (`executor_fix`)."""
