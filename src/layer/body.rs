use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};

use super::verdict::BodySettle;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The response body of a [`RateLimitService`](super::RateLimitService): the inner service's
    /// body, or the layer's own (a denial). Users keep their body type; this only wraps it.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        // Rules settled at the body's size: counts the bytes, settles when dropped.
        settle: Option<Box<BodySettle>>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            settle: None,
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
            settle: None,
        }
    }

    /// The service's body, counted for the rules settled at its size.
    pub(crate) fn settled(body: B, settle: Option<BodySettle>) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
            settle: settle.map(Box::new),
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f.write_str("ResponseBody::Inner"),
            Kind::Full { data } => f
                .debug_struct("ResponseBody::Full")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        match this.kind.project() {
            KindProj::Inner { body } => {
                let frame = body.poll_frame(cx);
                if let Some(settle) = this.settle.as_mut() {
                    match &frame {
                        Poll::Ready(Some(Ok(f))) => {
                            if let Some(data) = f.data_ref() {
                                settle.bytes = settle.bytes.saturating_add(data.remaining() as u64);
                            }
                        }
                        // The body is complete (or failed): settle now.
                        Poll::Ready(_) => drop(this.settle.take()),
                        Poll::Pending => {}
                    }
                }
                frame
            }
            KindProj::Full { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(B::Data::from(d)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
