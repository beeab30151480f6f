from nanocore.commands.cli import main

main()
