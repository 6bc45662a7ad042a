from kubetune.cli import main

main()
