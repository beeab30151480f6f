from nanocore.cli import main

main()
