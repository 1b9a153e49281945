from shard.cli.entry import main

main()
