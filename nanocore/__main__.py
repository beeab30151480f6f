from nanocore.commands.cli import main

if __name__ == "__main__":  # spawned processes (nanocore calibrate) import this module again
    main()
