"""The engine thread's answers into the HTTP server's event loop (`answers.Answers`)."""

import asyncio
import threading

from realrl.impl.generation.torch_server.answers import Answers


def test_answers_of_a_body_arrive_together_in_order_once_each():
    async def main():
        loop = asyncio.get_running_loop()
        answers = Answers(loop)
        done, single = loop.create_future(), loop.create_future()
        replies = answers.all_of(done, 3)
        wakeups = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            wakeups.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counting

        def engine():  # the engine thread answers out of order, one twice
            replies[2]("c")
            replies[0]("a")
            replies[0]("again")
            answers.setter(single)("s")
            replies[1]("b")

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        assert await done == ["a", "b", "c"]
        assert await single == "s"
        assert len(wakeups) == 1  # both answers went in one batch: the loop ran nothing in between

    asyncio.run(main())
