"""The subcommands of ``ampdoctor``: one module each, exposing ``add_arguments(parser)`` and ``run(args)``.

``ampdoctor.cli`` lists them in a fixed table and imports a module only when its command runs; ``common`` holds
what they share (usage errors, exit codes, output sanitising, number formatting).
"""
