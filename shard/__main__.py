from shard.entry import main

main()
