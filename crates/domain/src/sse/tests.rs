use super::*;

/// How many events of a whole stream (a stored answer) a client's parser
/// dispatches.
fn count_events(body: &[u8]) -> usize {
    let mut blocks = Blocks::default();
    let whole = blocks.push(body);
    let dispatched = |b: &Block| {
        matches!(
            b.kind,
            Kind::Event {
                dispatched: true,
                ..
            }
        )
    };
    whole.iter().filter(|b| dispatched(b)).count()
}

fn kinds(blocks: &[Block]) -> Vec<(String, Kind)> {
    blocks
        .iter()
        .map(|b| {
            (
                String::from_utf8_lossy(&b.bytes).into_owned(),
                b.kind.clone(),
            )
        })
        .collect()
}

fn event(id: Option<&str>) -> Kind {
    Kind::Event {
        id: id.map(str::to_owned),
        dispatched: true,
    }
}

/// Every block's bytes but heartbeats', concatenated: what is recorded.
fn answer(blocks: &[Block]) -> Vec<u8> {
    let answer = blocks.iter().filter(|b| b.kind != Kind::Beat);
    answer.flat_map(|b| b.bytes.to_vec()).collect()
}

#[test]
fn events_end_at_a_blank_line_whatever_the_line_endings() {
    let mut blocks = Blocks::default();
    let out = blocks.push(b"data: a\n\nid: 7\r\ndata: b\r\n\r\ndata: c\r\rdata: d\n\n");
    assert_eq!(
        kinds(&out),
        vec![
            ("data: a\n\n".into(), event(None)),
            ("id: 7\r\ndata: b\r\n\r\n".into(), event(Some("7"))),
            ("data: c\r\r".into(), event(None)),
            ("data: d\n\n".into(), event(None)),
        ]
    );
    assert!(blocks.pending_answer().is_empty());
}

#[test]
fn however_the_stream_is_split_its_bytes_and_events_are_the_same() {
    let stream = b"id: 1\r\ndata: {\"a\":1}\r\n\r\n: ping\r\n\r\ndata: two\r\n\r\n";
    for cut in 0..stream.len() {
        let mut blocks = Blocks::default();
        let mut out = blocks.push(&stream[..cut]);
        out.extend(blocks.push(&stream[cut..]));
        assert_eq!(
            String::from_utf8(answer(&out)).unwrap(),
            "id: 1\r\ndata: {\"a\":1}\r\n\r\ndata: two\r\n\r\n",
            "cut at {cut}"
        );
        let ids: Vec<_> = out
            .iter()
            .filter_map(|b| match &b.kind {
                Kind::Event { id, .. } => Some(id.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(ids, vec![Some("1".to_owned()), None], "cut at {cut}");
        let all: Vec<u8> = out.iter().flat_map(|b| b.bytes.to_vec()).collect();
        assert_eq!(all, stream, "no byte lost or changed, cut at {cut}");
        assert!(blocks.pending_answer().is_empty());
    }
}

#[test]
fn a_cr_ends_its_line_at_once_and_an_lf_after_it_goes_with_it() {
    let mut blocks = Blocks::default();
    let out = blocks.push(b"data: a\r\n\r");
    assert_eq!(kinds(&out), vec![("data: a\r\n\r".into(), event(None))]);
    let out = blocks.push(b"\ndata: b\r\r");
    assert_eq!(
        kinds(&out),
        vec![
            ("\n".into(), Kind::Part),
            ("data: b\r\r".into(), event(None)),
        ],
        "the LF is the answer's, the last event ends without waiting"
    );
    let out = blocks.push(b": hb\r");
    assert_eq!(kinds(&out), vec![(": hb\r".into(), Kind::Beat)]);
    let out = blocks.push(b"\n\r\n");
    assert_eq!(
        kinds(&out),
        vec![("\n".into(), Kind::Beat), ("\r\n".into(), Kind::Beat)],
        "a heartbeat's LF stays out of the answer"
    );
}

#[test]
fn lines_of_an_event_not_ended_go_out_as_they_come() {
    let mut blocks = Blocks::default();
    let out = blocks.push(b"data: a\ndata: b");
    assert_eq!(kinds(&out), vec![("data: a\n".into(), Kind::Part)]);
    assert_eq!(
        blocks.pending_answer(),
        b"data: b",
        "only a line not ended waits"
    );
    let out = blocks.push(b"\n\n");
    assert_eq!(kinds(&out), vec![("data: b\n\n".into(), event(None))]);
    // A line that never ends is not held past 64 KiB.
    let long = vec![b'x'; 70 * 1024];
    let mut blocks = Blocks::default();
    let out = blocks.push(&long);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].kind, Kind::Part);
    let out = blocks.push(b":not a comment\n\n");
    assert_eq!(
        kinds(&out),
        vec![(
            ":not a comment\n\n".into(),
            Kind::Event {
                id: None,
                dispatched: false
            }
        )],
        "the rest of a long line is content"
    );
}

#[test]
fn comments_before_a_field_are_a_heartbeat_given_out_at_once() {
    let mut blocks = Blocks::default();
    let out = blocks.push(b": keep-alive\n\n");
    assert_eq!(kinds(&out), vec![(": keep-alive\n\n".into(), Kind::Beat)]);
    // Heartbeat lines with no blank line of their own, then an event.
    let out = blocks.push(b":\n:\ndata: x\n: inside\n\n");
    assert_eq!(
        kinds(&out),
        vec![
            (":\n:\n".into(), Kind::Beat),
            ("data: x\n: inside\n\n".into(), event(None)),
        ]
    );
}

#[test]
fn a_line_never_ended_stays_pending_until_the_rest_is_taken() {
    let mut blocks = Blocks::default();
    let out = blocks.push(b"data: a\n\ndata: trunc");
    assert_eq!(out.len(), 1);
    assert_eq!(blocks.pending_answer(), b"data: trunc");
    assert_eq!(blocks.rest(), "data: trunc");
    assert_eq!(count_events(b"data: a\n\ndata: trunc"), 1);
}

#[test]
fn only_events_with_data_are_dispatched_and_counted() {
    let stream = b"retry: 100\n\nid: 1\n\nevent: x\ndata: a\n\nfoo: bar\n\ndata\n\n";
    let dispatched: Vec<_> = Blocks::default()
        .push(stream)
        .into_iter()
        .filter_map(|b| match b.kind {
            Kind::Event { dispatched, .. } => Some(dispatched),
            _ => None,
        })
        .collect();
    assert_eq!(dispatched, vec![false, false, true, false, true]);
    assert_eq!(count_events(stream), 2);
}

#[test]
fn the_id_is_the_last_id_field_of_the_event_as_a_parser_reads_it() {
    let mut blocks = Blocks::default();
    let out = blocks
        .push(b"id: 1\nid:2\ndata: x\n\nid\ndata: y\n\nidx: 3\ndata: z\n\nid: a\0b\ndata: w\n\n");
    let ids: Vec<_> = out.into_iter().map(|b| b.kind).collect();
    assert_eq!(
        ids,
        vec![event(Some("2")), event(Some("")), event(None), event(None)]
    );
    let (name, value) = field(b"data:  two spaces");
    assert_eq!(
        (name, value),
        (&b"data"[..], &b" two spaces"[..]),
        "one space dropped"
    );
}

#[test]
fn a_byte_order_mark_before_the_first_line_is_not_part_of_its_field() {
    let mut blocks = Blocks::default();
    let out = blocks.push("\u{feff}id: 9\ndata: x\n\n".as_bytes());
    assert_eq!(out[0].kind, event(Some("9")));
    assert!(
        out[0].bytes.starts_with("\u{feff}".as_bytes()),
        "kept as sent"
    );
}

fn point(id: Option<&str>, count: Option<&str>) -> Result<Option<ResumePoint>, BadResumePoint> {
    ResumePoint::parse(id.map(str::as_bytes), count.map(str::as_bytes))
}

#[test]
fn a_resume_point_is_one_header_sent_once_and_unambiguous() {
    assert_eq!(point(None, None), Ok(None));
    assert_eq!(point(None, Some("3")), Ok(Some(ResumePoint::After(3))));
    assert_eq!(
        point(None, Some("0")),
        Ok(None),
        "nothing received: from the start"
    );
    assert_eq!(
        point(Some("evt-3"), None),
        Ok(Some(ResumePoint::AfterId("evt-3".into())))
    );
    for bad in [
        "",
        "-1",
        "+3",
        " 3",
        "3.0",
        "three",
        "99999999999999999999999",
    ] {
        assert!(
            matches!(point(None, Some(bad)), Err(BadResumePoint::Count(_))),
            "{bad:?}"
        );
    }
    assert_eq!(point(Some(""), None), Err(BadResumePoint::Id));
    assert_eq!(point(Some("1"), Some("1")), Err(BadResumePoint::Both));
    let twice = ResumePoint::parse([&b"1"[..], b"2"], std::iter::empty());
    assert_eq!(twice, Err(BadResumePoint::Repeated("Last-Event-ID")));
}

/// What a resume hands on after `point`, the stream coming in `chunks`
/// (as `idempotency::resume` does: an LF the point's event still owns is
/// dropped from what follows).
fn skip(point: ResumePoint, chunks: &[&[u8]]) -> (Option<Vec<u8>>, usize) {
    let mut skip = Skip::new(point);
    let mut out: Option<Vec<u8>> = None;
    let mut drop_lf = false;
    for chunk in chunks {
        match &mut out {
            Some(out) => {
                let lf = drop_lf && chunk.first() == Some(&b'\n');
                drop_lf &= chunk.is_empty();
                out.extend_from_slice(&chunk[usize::from(lf)..]);
            }
            None => {
                if let Skipped::Reached(after) = skip.push(chunk) {
                    out = Some(after.to_vec());
                    drop_lf = skip.drops_lf();
                }
            }
        }
    }
    (out, skip.skipped())
}

#[test]
fn skipping_hands_on_exactly_the_bytes_after_the_point() {
    let stream: &[u8] =
        b"id: e1\ndata: 1\n\n: ping\n\nid: e2\ndata: 2\n\nid: e3\ndata: 3\n\ndata: tail";
    for cut in 0..stream.len() {
        let chunks = [&stream[..cut], &stream[cut..]];
        let (after, skipped) = skip(ResumePoint::After(2), &chunks);
        assert_eq!(
            after.as_deref(),
            Some(&b"id: e3\ndata: 3\n\ndata: tail"[..]),
            "cut at {cut}"
        );
        assert_eq!(skipped, 2);
        let (after, _) = skip(ResumePoint::AfterId("e1".into()), &chunks);
        assert_eq!(
            after.as_deref(),
            Some(&b": ping\n\nid: e2\ndata: 2\n\nid: e3\ndata: 3\n\ndata: tail"[..])
        );
    }
    let (after, _) = skip(ResumePoint::After(0), &[stream]);
    assert_eq!(after.as_deref(), Some(stream), "zero skips nothing");
    let (after, _) = skip(ResumePoint::After(3), &[stream]);
    assert_eq!(
        after.as_deref(),
        Some(&b"data: tail"[..]),
        "the end of the last event"
    );
    let (after, skipped) = skip(ResumePoint::After(4), &[stream]);
    assert_eq!((after, skipped), (None, 3), "past the last event");
    let (after, _) = skip(ResumePoint::AfterId("e9".into()), &[stream]);
    assert_eq!(after, None, "an id the stream never sent");
}

/// The answer, the events and every byte of a stream cut into blocks as it
/// comes in `chunks`.
fn cut(chunks: &[&[u8]]) -> (Vec<u8>, Vec<Kind>, Vec<u8>) {
    let mut blocks = Blocks::default();
    let mut out: Vec<Block> = chunks.iter().flat_map(|c| blocks.push(c)).collect();
    out.extend(blocks.finish());
    let events = out
        .iter()
        .filter(|b| matches!(b.kind, Kind::Event { .. }))
        .map(|b| b.kind.clone())
        .collect();
    let all = out.iter().flat_map(|b| b.bytes.to_vec()).collect();
    (answer(&out), events, all)
}

const STREAMS: [&[u8]; 4] = [
    b"data: 1\r\n\ndata: 2\n\n: ping\n\ndata: 3\n\n",
    b"id: a\rdata: 1\r\r\n: hb\r\r\ndata: 2\r\n\r\n:\n\nevent: e\ndata\n\n",
    b"\r\n: x\n\r\rid: 7\r\n\r\ndata: z\r\r\r\ndata: tail",
    b": only\r: beats\n\r\n",
];

#[test]
fn every_way_of_splitting_a_stream_gives_the_same_answer_and_events() {
    for stream in STREAMS {
        let whole = cut(&[stream]);
        assert_eq!(whole.2, stream);
        for i in 0..=stream.len() {
            for j in i..=stream.len() {
                let split = cut(&[&stream[..i], &stream[i..j], &stream[j..]]);
                assert_eq!(
                    split,
                    whole,
                    "{:?} cut at {i} and {j}",
                    String::from_utf8_lossy(stream)
                );
            }
        }
    }
}

#[test]
fn a_resume_hands_on_the_same_bytes_however_the_stream_was_split() {
    for stream in STREAMS {
        for n in 1..=3 {
            let whole = skip(ResumePoint::After(n), &[stream]);
            for i in 0..=stream.len() {
                for j in i..=stream.len() {
                    let split = skip(
                        ResumePoint::After(n),
                        &[&stream[..i], &stream[i..j], &stream[j..]],
                    );
                    assert_eq!(
                        split,
                        whole,
                        "{:?} after {n}, cut at {i} and {j}",
                        String::from_utf8_lossy(stream)
                    );
                }
            }
        }
    }
}

#[test]
fn heartbeats_never_change_the_answer_however_they_come() {
    let events: [&[u8]; 3] = [b"data: 1\r\n\r\n", b"id: 2\rdata: 2\r\r", b"data: 3\n\n"];
    // (A heartbeat starts with its comment: a blank line right after an
    // event ended by a CR would be the rest of that event's CRLF.)
    let beats: [&[u8]; 3] = [b": ping\r\n\r\n", b":\r", b": a\n: b\n\n\n"];
    let bare: Vec<u8> = events.concat();
    for beat in beats {
        let mut beaten = Vec::new();
        for event in events {
            beaten.extend_from_slice(beat);
            beaten.extend_from_slice(event);
        }
        beaten.extend_from_slice(beat);
        for i in 0..=beaten.len() {
            let (answer, kinds, _) = cut(&[&beaten[..i], &beaten[i..]]);
            assert_eq!(
                answer,
                cut(&[&bare]).0,
                "{:?} cut at {i}",
                String::from_utf8_lossy(&beaten)
            );
            assert_eq!(kinds.len(), 3);
        }
    }
}

#[test]
fn a_line_too_long_to_hold_is_what_its_start_says() {
    let long = |head: &str| {
        let mut line = head.as_bytes().to_vec();
        line.extend(std::iter::repeat_n(b'x', 100_000));
        line
    };
    let frames = |stream: &[u8]| {
        stream
            .chunks(16 * 1024)
            .map(<[u8]>::to_vec)
            .collect::<Vec<_>>()
    };
    for (head, events) in [("data: ", 2), ("id: ", 1), (":", 1), ("retry: ", 1)] {
        let mut stream = long(head);
        stream.extend_from_slice(b"\n\ndata: 2\n\n");
        let whole = cut(&[&stream]);
        let framed = frames(&stream);
        let framed = cut(&framed.iter().map(Vec::as_slice).collect::<Vec<_>>());
        assert_eq!(framed, whole, "{head}");
        assert_eq!(count_events(&stream), events, "{head}");
        let ids = whole
            .1
            .iter()
            .filter(|k| matches!(k, Kind::Event { id: Some(_), .. }));
        assert_eq!(ids.count(), 0, "{head}: an id this long is ignored");
    }
    let mut comment = long(":");
    comment.extend_from_slice(b"\n\ndata: 1\n\n");
    let framed = frames(&comment);
    let (answer, ..) = cut(&framed.iter().map(Vec::as_slice).collect::<Vec<_>>());
    assert_eq!(
        answer, b"data: 1\n\n",
        "a long comment is still a heartbeat"
    );
}

#[test]
fn an_unended_comment_at_the_end_is_a_heartbeat_not_the_answer() {
    let (answer, ..) = cut(&[b"data: 1\n\n: ping"]);
    assert_eq!(answer, b"data: 1\n\n");
    let (answer, ..) = cut(&[b"data: 1\n\ndata: tr"]);
    assert_eq!(answer, b"data: 1\n\ndata: tr");
}
